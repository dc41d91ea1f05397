"""Planning a run before it starts: memory and bytes sent (estimate*, traffic), and the layout (planner)."""
