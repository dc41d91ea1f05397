"""Pipeline parallelism: the model's layers cut into stages, one per rank of the pp group.

Read in this order: `schedules` (each schedule as data: a list of F/B/W actions per rank, with no
processes and no model), `timeline` (those actions simulated on a clock, drawn and measured),
and `executor` (the one `Pipeline` that runs any schedule's actions with real sends and receives);
chapter 1's order_check.py proves that every rank's sends meet its neighbours' receives in order.
"""
