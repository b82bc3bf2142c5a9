"""Terminal and JSON reports: the layout report (dry run) and the planner's estimate/search/simulation."""
