from ksi_common.client import KsiClient


async def test_health_reports_counts(client: KsiClient) -> None:
    health = await client.request("system:health")
    assert health["status"] == "healthy"
    assert health["connections"] == 1
