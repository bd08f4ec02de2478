"""Floor 5, the run: the one step sequence (`pipeline`), the run recorder (`runs`), the DAG lock, the watch after a
promotion and the read-only views (`status`, `pageview`). May import every floor below, never an edge."""
