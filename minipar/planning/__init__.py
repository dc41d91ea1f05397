"""Planning a run before it starts: `estimate` predicts each rank's memory and bytes sent for a
layout, `estimate_moe` adds the experts, and `planner` ranks the layouts that fit."""
