"""The deployment files: docker-compose.yml has the services, healthchecks, volumes and GPU
reservation a deployment needs, the Dockerfile has both images, and every command they run exists
in the CLI (`opfuse ...`) or in `python -m service`. Docker itself does not run here."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from client.cli import app as cli_app
from service.__main__ import build_parser

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return loaded


@pytest.fixture(scope="module")
def dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def argv(service: dict[str, Any], dockerfile: str, target: str) -> list[str]:
    """The full command a service runs: its entrypoint (the image's unless overridden) + command."""
    entrypoint = service.get("entrypoint")
    if entrypoint is None:
        stage = dockerfile.split(f" AS {target}\n", 1)[1].split("\nFROM ", 1)[0]
        entrypoint = yaml.safe_load(re.search(r"^ENTRYPOINT (.+)$", stage, re.M).group(1))  # type: ignore[union-attr]
    command = service.get("command") or []
    return [*entrypoint, *command]


def target_of(compose: dict[str, Any], name: str) -> str:
    image = compose["services"][name]["image"]
    for service in compose["services"].values():
        if service.get("image") == image and "build" in service:
            return str(service["build"]["target"])
    raise AssertionError(f"nothing builds the image of {name}")


def test_services_volumes_and_order(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"postgres", "migrate", "api", "worker"}
    assert "pgdata:/var/lib/postgresql/data" in services["postgres"]["volumes"]
    assert set(compose["volumes"]) == {"pgdata", "opfuse-home"}
    assert services["migrate"]["restart"] == "no"
    assert services["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert services["api"]["depends_on"] == {"migrate": {"condition": "service_completed_successfully"}}
    assert services["worker"]["depends_on"] == {"api": {"condition": "service_healthy"}}
    for name in ("migrate", "api"):
        assert services[name]["environment"]["OPFUSE_DATABASE_URL"].startswith("postgresql+psycopg://")
    assert "OPFUSE_DATABASE_URL" not in (services["worker"].get("environment") or {})  # API only


def test_healthchecks(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert "pg_isready" in " ".join(services["postgres"]["healthcheck"]["test"])
    api_check = " ".join(services["api"]["healthcheck"]["test"])
    assert "/readyz" in api_check and "8000" in api_check


def test_the_worker_reserves_a_gpu_and_needs_only_the_api(compose: dict[str, Any], dockerfile: str) -> None:
    worker = compose["services"]["worker"]
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    command = argv(worker, dockerfile, target_of(compose, "worker"))
    assert command[command.index("--api") + 1] == "http://api:8000"
    key_file = command[command.index("--key-file") + 1]
    assert any(v.endswith(":ro") and key_file.startswith(v.split(":")[1]) for v in worker["volumes"])
    assert command[command.index("--gpu") + 1] == device["device_ids"][0]


def test_dockerfile_has_both_images_as_a_non_root_user(dockerfile: str) -> None:
    stages = {target: base for base, target in re.findall(r"^FROM (\S+) AS (\w+)$", dockerfile, re.M)}
    assert set(stages) == {"api", "worker"}
    assert stages["worker"] == "${CUDA_IMAGE}"
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:12\.\S+-runtime-", dockerfile, re.M)
    for target in stages:
        stage = dockerfile.split(f" AS {target}\n", 1)[1].split("\nFROM ", 1)[0]
        assert re.search(r"^USER opfuse$", stage, re.M), target
        assert 'ENTRYPOINT ["opfuse"]' in stage


def _cli_accepts(args: list[str]) -> None:
    """`opfuse <command> [options]`: the command exists and takes every option given."""
    command = args[0]
    help_text = CliRunner().invoke(cli_app, [command, "--help"], terminal_width=200)
    assert help_text.exit_code == 0, f"`opfuse {command}` does not exist: {help_text.output}"
    for option in (a for a in args[1:] if a.startswith("--")):
        assert option in help_text.output, f"`opfuse {command}` has no option {option}"


def _service_accepts(args: list[str]) -> None:
    """`python -m service <command>`: the subcommand exists."""
    try:
        parsed = build_parser().parse_args(args)
    except SystemExit:
        raise AssertionError(f"`python -m service {' '.join(args)}` is not a command") from None
    assert parsed.command == args[0]


def test_every_command_exists(compose: dict[str, Any], dockerfile: str) -> None:
    checked = 0
    for name, service in compose["services"].items():
        if name == "postgres":
            continue
        command = argv(service, dockerfile, target_of(compose, name))
        if command[0] == "opfuse":
            _cli_accepts(command[1:])
        elif command[:3] == ["python", "-m", "service"]:
            _service_accepts(command[3:])
        else:
            raise AssertionError(f"{name} runs {command}, which the tests do not know")
        checked += 1
    assert checked == 3
    # The images' default commands too.
    for default in re.findall(r"^CMD (\[.+\])$", dockerfile, re.M):
        _cli_accepts(yaml.safe_load(default))
