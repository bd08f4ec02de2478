"""The state DB: versions, their manifests, runs, alias events and locks (SQLAlchemy Core).

SQLite by default, MySQL/MariaDB through pymysql in production, or PostgreSQL through psycopg. The schema is
created on first use.
Qdrant holds vectors; this holds what they are supposed to be, so every check has something to compare.

One module per concern: `schema` (tables, upgrades), `versions`, `manifests` (+ the plan's snapshot and the
file hash cache), `runs`, `history` (alias events, pins, audits), `freezes` (the freeze of an alias),
`locks` (owner format, liveness, takeover), `clock` (the time every decision reads), `store` (`StateStore`, composed of them). Import each name from its own module.
"""
