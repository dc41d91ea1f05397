"""Planning a run before it starts: `estimate` predicts each rank's memory and bytes sent for a
layout, `estimate_moe` adds the experts, `estimate_zeropp` ZeRO++'s messages and hpZ's copy, and
`planner` ranks the layouts that fit."""
