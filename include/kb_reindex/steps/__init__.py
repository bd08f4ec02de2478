"""Floor 4, the steps of a run (plan, snapshot, build, validate, promote, rollback, retention, reconcile) and their
parts (golden set, replay, query log, reports). May import `domain`, `services`, `rules`; a step never imports another step."""
