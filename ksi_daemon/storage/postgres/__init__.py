"""The PostgreSQL storage backend (KSI_STORAGE=postgres): asyncpg, a pool, a migrated schema."""
