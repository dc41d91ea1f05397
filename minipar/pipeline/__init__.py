"""Pipeline parallelism: the model's layers cut into stages, one per rank of the pp group.

Read in this order: `schedules` (each schedule as data: a list of F/B/W actions per rank, with no
processes and no model), `timeline` (those actions simulated on a clock, drawn and measured),
`executor` (the one `Pipeline` that runs any schedule's actions with real sends and receives) and
`order_check` (the proof that every rank's sends meet the receives of its neighbours in order).
"""
