"""The default per-job memory limit was 32 GiB on any host, more than many hosts have: a job could
push the host into swap or the OOM killer before its own limit stopped it. The default is now
derived from the host: min(32 GiB, 75% of MemTotal, or of the container's cgroup limit, / the jobs
run at once)."""

from __future__ import annotations

from pathlib import Path

import pytest

GiB = 1024**3


def _meminfo_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal in /proc/meminfo")


def test_the_default_job_limit_fits_this_host() -> None:
    from workers.config import WorkerConfig, worker_config

    host = _meminfo_total()
    default = WorkerConfig(api_url="http://127.0.0.1:9", api_key="opf_x").job_memory_bytes
    assert default is not None and default <= 0.75 * host + 1
    assert default <= 32 * GiB
    from_cli = worker_config("http://127.0.0.1:9", "opf_x", None, None, None)
    assert from_cli.job_memory_bytes == default
    # An explicit value still wins; 0 is no limit.
    assert (
        worker_config("http://127.0.0.1:9", "opf_x", None, None, None, job_memory_gb=4).job_memory_bytes
        == 4 * GiB
    )
    assert (
        worker_config("http://127.0.0.1:9", "opf_x", None, None, None, job_memory_gb=0).job_memory_bytes
        is None
    )


def _host(
    tmp_path: Path, mem_total_kb: int, cgroup: str | None = None, v1: str | None = None
) -> tuple[Path, Path]:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(
        f"MemTotal:       {mem_total_kb} kB\nMemFree:        1234 kB\nMemAvailable:   5678 kB\n"
    )
    root = tmp_path / "cgroup"
    root.mkdir()
    if cgroup is not None:
        (root / "memory.max").write_text(cgroup + "\n")
    if v1 is not None:
        (root / "memory").mkdir()
        (root / "memory" / "memory.limit_in_bytes").write_text(v1 + "\n")
    return meminfo, root


@pytest.mark.parametrize(
    ("mem_total_gib", "cgroup", "v1", "expected_gib"),
    [
        (8, None, None, 6),  # 75% of a small host
        (24, "max", None, 18),  # cgroup v2 without a limit
        (256, None, None, 32),  # a big host: the 32 GiB cap
        (64, str(4 * GiB), None, 3),  # a container of 4 GiB on a big host
        (64, None, str(8 * GiB), 6),  # cgroup v1
        (64, None, str(2**63 - 4096), 32),  # cgroup v1's "no limit"
    ],
)
def test_host_memory_and_the_derived_default(
    tmp_path: Path, mem_total_gib: int, cgroup: str | None, v1: str | None, expected_gib: float
) -> None:
    from workers.limits import default_job_memory_bytes, host_memory_bytes

    meminfo, root = _host(tmp_path, mem_total_gib * 1024 * 1024, cgroup, v1)
    host = host_memory_bytes(meminfo, root)
    assert host is not None
    assert default_job_memory_bytes(host) == int(expected_gib * GiB)


def test_concurrent_jobs_share_the_host_and_unknown_hosts_keep_the_cap(tmp_path: Path) -> None:
    from workers.limits import default_job_memory_bytes, host_memory_bytes

    assert default_job_memory_bytes(16 * GiB, concurrent_jobs=4) == 3 * GiB
    assert host_memory_bytes(tmp_path / "missing", tmp_path / "none") is None
    (tmp_path / "garbage").write_text("MemTotal: lots\n")
    assert host_memory_bytes(tmp_path / "garbage", tmp_path / "none") is None
    assert default_job_memory_bytes(None) <= 32 * GiB  # this host, read for real
