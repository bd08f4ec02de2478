"""The production stack, checked structurally: docker-compose.yml, .env.example, the Airflow Dockerfile and
the init scripts, against each other and against the code (Connection ids, pool, settings).

No container is started (there may be no Docker engine); `docker compose config` runs only where a
compose tool is installed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml
from conftest import REPO

COMPOSE_FILE = REPO / "docker-compose.yml"
ENV_EXAMPLE = REPO / ".env.example"
DOCKERFILE = REPO / "docker" / "airflow" / "Dockerfile"
AIRFLOW_INIT = REPO / "docker" / "airflow" / "init.sh"
MYSQL_INIT = REPO / "docker" / "mysql-init" / "01-databases.sh"

AIRFLOW_VERSION_PIN = re.compile(r"^apache-airflow==(\S+)$", re.MULTILINE)
# ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?message}, ${VAR?message}, ${VAR:+alt}, $VAR; `$$` is an
# escaped dollar that compose leaves to the container's shell.
INTERPOLATION = re.compile(r"\$\$|\$\{(?P<braced>[A-Za-z_]\w*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}|\$(?P<bare>[A-Za-z_]\w*)")
SECRET_KEY = re.compile(r"(PASSWORD|PASSWD|SECRET|SECRET_KEY|API_KEY|TOKEN|FERNET_KEY)$", re.IGNORECASE)
SECRET_VAR = re.compile(r"(PASSWORD|SECRET|API_KEY|TOKEN|FERNET_KEY)$")
# A whole value that is a reference without a literal fallback: ${VAR}, ${VAR:?msg} or ${VAR?msg}.
PURE_REFERENCE = re.compile(r"^\$\{[A-Za-z_]\w*(?::?\?[^}]*)?\}$")
PATCH_VERSION = re.compile(r"\d+\.\d+\.\d+")

STATEFUL_MOUNTS = {"mysql": "/var/lib/mysql", "qdrant": "/qdrant/storage", "ollama": "/root/.ollama"}
ONE_SHOT = {"ollama-pull", "airflow-init"}


# --- loading --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    assert COMPOSE_FILE.is_file(), "docker-compose.yml is missing"
    data = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
    assert isinstance(data, dict) and isinstance(data.get("services"), dict), "no services in docker-compose.yml"
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


@pytest.fixture(scope="module")
def env_example() -> dict[str, str]:
    return parse_env_file(ENV_EXAMPLE)


@pytest.fixture(scope="module")
def airflow_services(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Services running the project's Airflow image (built from docker/airflow/Dockerfile)."""
    found = {name: svc for name, svc in services.items() if is_airflow(svc)}
    assert found, "no service is built from docker/airflow/Dockerfile"
    return found


@pytest.fixture(scope="module")
def init_commands() -> list[list[str]]:
    return shell_commands(AIRFLOW_INIT.read_text(encoding="utf-8"))


def parse_env_file(path: Path) -> dict[str, str]:
    assert path.is_file(), f"{path.name} is missing"
    values: dict[str, str] = {}
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"(?:export\s+)?([A-Za-z_]\w*)=(.*)", line)
        assert match, f"{path.name}:{number} is not KEY=VALUE: {raw!r}"
        key, value = match.groups()
        assert key not in values, f"{path.name}: {key} is defined twice"
        values[key] = value.strip().strip("'\"")
    return values


def is_airflow(service: dict[str, Any]) -> bool:
    build = service.get("build")
    if isinstance(build, dict):
        return PurePosixPath(build.get("dockerfile", "Dockerfile")) == PurePosixPath("docker/airflow/Dockerfile")
    return False


def strings(node: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """Every string value in the compose tree with its dotted path (keys are not interpolated)."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from strings(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from strings(value, f"{path}[{index}]")
    elif isinstance(node, str):
        yield path, node


def references(text: str) -> list[tuple[str, str | None, str]]:
    """(variable, operator, whole reference) for each interpolation in a value; `$$` escapes skipped."""
    found = []
    for match in INTERPOLATION.finditer(text):
        name = match.group("braced") or match.group("bare")
        if name:
            found.append((name, match.group("op"), match.group(0)))
    return found


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's interpolation, enough of it to resolve this file against .env.example."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group("braced") or match.group("bare")
        op, arg, value = match.group("op"), match.group("arg") or "", env.get(name)
        if op in (":-", "-"):
            return value if (value if op == ":-" else value is not None) else arg
        if op in (":?", "?"):
            if value is None or (op == ":?" and not value):
                raise AssertionError(f"required variable {name} is unset: {arg}")
            return value
        if op in (":+", "+"):
            return arg if (value if op == ":+" else value is not None) else ""
        return value or ""

    return INTERPOLATION.sub(replace, text)


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(key): "" if value is None else str(value) for key, value in env.items()}


def depends_on(service: dict[str, Any]) -> dict[str, str]:
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return {name: "service_started" for name in deps}
    return {name: (spec or {}).get("condition", "service_started") for name, spec in deps.items()}


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> source (named volume or host path) for each volume of a service."""
    found = {}
    for volume in service.get("volumes") or []:
        if isinstance(volume, dict):
            found[volume["target"]] = volume.get("source", "")
        else:
            parts = volume.split(":")
            if len(parts) >= 2:
                found[parts[1]] = parts[0]
    return found


def container_ports(service: dict[str, Any]) -> set[int]:
    ports = set()
    for port in service.get("ports") or []:
        target = port.get("target") if isinstance(port, dict) else str(port).rsplit(":", 1)[-1].split("/")[0]
        ports.add(int(target))
    return ports


def healthcheck_text(service: dict[str, Any]) -> str:
    test = (service.get("healthcheck") or {}).get("test")
    assert test, "no healthcheck test"
    return " ".join(test) if isinstance(test, list) else str(test)


def shell_commands(script: str) -> list[list[str]]:
    """The script's simple commands as argv lists (continuations joined, $(...) kept as one word)."""
    joined = script.replace("\\\n", " ")
    commands = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # a heredoc body or another line that is not a simple command
            continue
        if words:
            commands.append(words)
    return commands


def image_is_pinned(image: str) -> bool:
    if "@sha256:" in image:
        return True
    name, _, tag = image.rpartition(":")
    if not name or "/" in tag:  # no tag at all ("redis", "registry:5000/redis")
        return False
    return tag != "latest" and bool(PATCH_VERSION.search(tag))


def resolved_airflow_env(service: dict[str, Any], env: dict[str, str]) -> dict[str, str]:
    return {key: interpolate(value, env) for key, value in environment(service).items()}


# --- services and images ----------------------------------------------------------------------------


def test_the_stack_has_its_services(services: dict[str, dict[str, Any]]) -> None:
    expected = {"mysql", "qdrant", "ollama", "ollama-pull", "airflow-init", "airflow-apiserver",
                "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer", "redis", "airflow-worker"}
    assert expected <= set(services), f"missing services: {sorted(expected - set(services))}"


def test_every_service_has_a_pinned_image_or_a_build(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        image, build = service.get("image"), service.get("build")
        assert image or build, f"{name}: neither image nor build"
        if image:
            assert "$" not in image, f"{name}: image {image!r} depends on the environment"
            assert image_is_pinned(image), f"{name}: image {image!r} is not pinned to a version tag"


def test_base_images_are_the_expected_products(services: dict[str, dict[str, Any]]) -> None:
    assert re.fullmatch(r"mysql:8\.4\.\d+", services["mysql"]["image"])
    assert re.fullmatch(r"qdrant/qdrant:v1\.\d+\.\d+", services["qdrant"]["image"])
    assert services["ollama"]["image"].startswith("ollama/ollama:")
    assert services["ollama-pull"]["image"] == services["ollama"]["image"], "pull with the server's own version"
    assert services["redis"]["image"].startswith("redis:")


def test_qdrant_server_is_compatible_with_the_pinned_client(services: dict[str, dict[str, Any]]) -> None:
    """qdrant-client warns when the server's minor version is more than one away from its own."""
    client = re.search(r"^qdrant-client==(\d+)\.(\d+)\.", (REPO / "constraints.txt").read_text(), re.MULTILINE)
    server = re.search(r":v(\d+)\.(\d+)\.", services["qdrant"]["image"])
    assert client and server
    assert client.group(1) == server.group(1) and abs(int(client.group(2)) - int(server.group(2))) <= 1, (
        f"qdrant server {services['qdrant']['image']} vs qdrant-client {client.group(0)}"
    )


def test_all_airflow_services_share_one_image(airflow_services: dict[str, dict[str, Any]]) -> None:
    expected = {"airflow-init", "airflow-apiserver", "airflow-scheduler", "airflow-dag-processor",
                "airflow-triggerer", "airflow-worker"}
    assert expected <= set(airflow_services)
    assert len({svc.get("image") for svc in airflow_services.values()}) == 1
    for name, service in airflow_services.items():
        assert service["build"].get("context") in (".", "./"), f"{name}: build context is not the repo root"


def test_no_pip_install_at_container_start(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        assert "_PIP_ADDITIONAL_REQUIREMENTS" not in environment(service), f"{name}: install into the image instead"


# --- state, health, order ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(STATEFUL_MOUNTS))
def test_stateful_services_keep_data_in_named_volumes(compose: dict[str, Any], name: str) -> None:
    target = STATEFUL_MOUNTS[name]
    source = mounts(compose["services"][name]).get(target)
    assert source, f"{name}: nothing mounted on {target}"
    assert source in (compose.get("volumes") or {}), f"{name}: {source!r} is not a named volume"


def test_airflow_reports_and_logs_are_volumes(compose: dict[str, Any], airflow_services: dict[str, dict[str, Any]],
                                              env_example: dict[str, str]) -> None:
    for name, service in airflow_services.items():
        reports = resolved_airflow_env(service, env_example)["KB_REPORTS_DIR"]
        volumes = mounts(service)
        for target in (reports, "/opt/airflow/logs"):
            assert volumes.get(target) in (compose.get("volumes") or {}), f"{name}: {target} is not a named volume"


@pytest.mark.parametrize("name", ["mysql", "qdrant", "ollama", "airflow-apiserver"])
def test_health_checks(services: dict[str, dict[str, Any]], name: str) -> None:
    text = healthcheck_text(services[name])
    expected = {"mysql": "mysqladmin ping", "qdrant": "/dev/tcp/127.0.0.1/6333", "ollama": "ollama list",
                "airflow-apiserver": "/api/v2/monitor/health"}[name]
    assert expected in text, f"{name}: healthcheck {text!r}"


def test_qdrant_healthcheck_uses_no_tool_the_image_lacks(services: dict[str, dict[str, Any]]) -> None:
    text = healthcheck_text(services["qdrant"])
    assert not re.search(r"\b(curl|wget|nc)\b", text), "the qdrant image has no curl, wget or nc"
    assert "/readyz" in text


def test_every_long_running_service_has_a_healthcheck(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        if name not in ONE_SHOT:
            assert (service.get("healthcheck") or {}).get("test"), f"{name}: no healthcheck"


def test_published_ports(services: dict[str, dict[str, Any]]) -> None:
    assert {6333, 6334} <= container_ports(services["qdrant"])
    assert 8080 in container_ports(services["airflow-apiserver"])


def test_airflow_waits_for_mysql_qdrant_and_the_model(airflow_services: dict[str, dict[str, Any]]) -> None:
    for name, service in airflow_services.items():
        deps = depends_on(service)
        assert deps.get("mysql") == "service_healthy", f"{name}: does not wait for mysql to be healthy"
        assert deps.get("qdrant") == "service_healthy", f"{name}: does not wait for qdrant to be healthy"
        assert deps.get("ollama-pull") == "service_completed_successfully", f"{name}: does not wait for the model"
        if name != "airflow-init":
            assert deps.get("airflow-init") == "service_completed_successfully", f"{name}: runs before airflow-init"


def test_model_pull_waits_for_a_healthy_ollama(services: dict[str, dict[str, Any]]) -> None:
    pull = services["ollama-pull"]
    assert depends_on(pull).get("ollama") == "service_healthy"
    entrypoint = pull.get("entrypoint")
    assert isinstance(entrypoint, list) and entrypoint[:2] == ["ollama", "pull"], entrypoint
    assert environment(pull).get("OLLAMA_HOST") == "http://ollama:11434"


def test_dependencies_are_consistent(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        for dep, condition in depends_on(service).items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            assert condition in ("service_healthy", "service_completed_successfully"), f"{name} -> {dep}: {condition}"
            if condition == "service_healthy":
                assert services[dep].get("healthcheck"), f"{name} waits for {dep} to be healthy; it has no healthcheck"
            if condition == "service_completed_successfully":
                assert dep in ONE_SHOT, f"{name} waits for long-running {dep} to complete"
            if not service.get("profiles"):
                assert not services[dep].get("profiles"), f"{name} (default profile) depends on profile-only {dep}"


def test_restart_policies(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        if name in ONE_SHOT:
            assert service.get("restart", "no") == "no", f"{name} is one-shot; it must not restart"
        else:
            assert service.get("restart") == "unless-stopped", f"{name}: restart {service.get('restart')!r}"


def test_task_supervisors_look_every_second_as_under_make_airflow(
        airflow_services: dict[str, dict[str, Any]], env_example: dict[str, str]) -> None:
    """Airflow 3.3's supervisor can miss a task process's exit until its next look: both stacks look every second."""
    script = (REPO / "scripts" / "airflow.sh").read_text(encoding="utf-8")
    assert 'AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL="${AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL:-1}"' in script
    for name, service in airflow_services.items():
        env = resolved_airflow_env(service, env_example)
        assert env.get("AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL") == "1", name


def test_celery_is_an_opt_in_profile(services: dict[str, dict[str, Any]], airflow_services: dict[str, dict[str, Any]],
                                     env_example: dict[str, str]) -> None:
    for name, service in services.items():
        expected = ["celery"] if name in ("redis", "airflow-worker", "airflow-worker-oncall") else None
        assert service.get("profiles") == expected, f"{name}: profiles {service.get('profiles')!r}"
    assert services["airflow-worker"]["command"] in ("celery worker", ["celery", "worker"])
    # on-call's worker takes on-call's queue alone, the one the DAG files put rollbacks on; the build workers
    # take Airflow's default queue only (no --queues)
    common = resolved_airflow_env(services["airflow-worker-oncall"], env_example)
    oncall = interpolate(services["airflow-worker-oncall"]["command"], env_example).split()
    assert oncall[:2] == ["celery", "worker"] and oncall[oncall.index("--queues") + 1] == common["KB_ONCALL_QUEUE"]
    assert common["KB_ONCALL_QUEUE"] == "kb_oncall" and common["KB_ONCALL_POOL"] == "kb_oncall"
    assert oncall[oncall.index("--concurrency") + 1] == common["KB_ONCALL_SLOTS"]
    env = resolved_airflow_env(airflow_services["airflow-scheduler"], env_example)
    assert env["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor", "LocalExecutor is the default"
    assert env["AIRFLOW__CELERY__BROKER_URL"].startswith("redis://redis:")
    # as tested (tests/airflow_dags/test_celery_airflow.py): the result backend is the metadata DB, one task per worker at
    # once, and each task instance names the worker that ran it
    assert "AIRFLOW__CELERY__RESULT_BACKEND" not in env
    worker = resolved_airflow_env(services["airflow-worker"], env_example)
    assert worker["AIRFLOW__CELERY__WORKER_CONCURRENCY"] == "1"
    assert worker["AIRFLOW__CORE__HOSTNAME_CALLABLE"] == "kb_reindex.airflow.hostname.worker_hostname"
    from kb_reindex.airflow.hostname import worker_hostname

    assert worker["AIRFLOW__CORE__HOSTNAME_CALLABLE"] == f"{worker_hostname.__module__}.{worker_hostname.__name__}"
    assert worker_hostname() == socket.getfqdn(), "unset KB_WORKER_HOSTNAME: the container's own name"


# --- secrets and .env.example ------------------------------------------------------------------------------


def test_every_variable_is_defined_in_env_example(compose: dict[str, Any], env_example: dict[str, str]) -> None:
    used = {name for _, value in strings(compose) for name, _, _ in references(value)}
    assert used, "the compose file references no variable at all"
    missing = sorted(used - set(env_example))
    assert not missing, f"referenced in docker-compose.yml but not in .env.example: {missing}"
    unused = sorted(set(env_example) - used)
    assert not unused, f"in .env.example but never used by docker-compose.yml: {unused}"


def test_secret_variables_are_required_and_have_no_default(compose: dict[str, Any]) -> None:
    seen = set()
    for path, value in strings(compose):
        for name, op, whole in references(value):
            if SECRET_VAR.search(name):
                seen.add(name)
                assert op in (":?", "?"), f"{path}: {whole} must fail when unset (${{{name}:?message}})"
    assert {"MYSQL_ROOT_PASSWORD", "AIRFLOW_DB_PASSWORD", "KB_STATE_DB_PASSWORD", "QDRANT_API_KEY",
            "AIRFLOW_JWT_SECRET", "AIRFLOW_FERNET_KEY", "AIRFLOW_ADMIN_PASSWORD"} <= seen


def test_no_literal_secret_in_the_compose_file(compose: dict[str, Any]) -> None:
    def walk(node: Any, path: str) -> Iterator[tuple[str, str, Any]]:
        if isinstance(node, dict):
            for key, value in node.items():
                yield path, str(key), value
                yield from walk(value, f"{path}.{key}")
        elif isinstance(node, list):
            for index, item in enumerate(node):
                if isinstance(item, str) and re.match(r"^[A-Za-z_]\w*=", item):  # KEY=VALUE environment item
                    key, value = item.split("=", 1)
                    yield path, key, value
                yield from walk(item, f"{path}[{index}]")

    for path, key, value in walk(compose, ""):
        if SECRET_KEY.search(key) and not isinstance(value, (dict, list)):
            assert isinstance(value, str) and PURE_REFERENCE.match(value), (
                f"{path}.{key} = {value!r}: a secret must be a ${{VAR}} / ${{VAR:?msg}} reference"
            )
    for path, value in strings(compose):
        masked = INTERPOLATION.sub(lambda m: "<ref>" if m.group(0) != "$$" else "$$", value)
        for userinfo in re.findall(r"://([^/@\s]+)@", masked):
            if ":" in userinfo:
                assert userinfo.split(":", 1)[1] == "<ref>", f"{path}: URL with a literal password: {value!r}"


def test_env_example_holds_only_placeholders(env_example: dict[str, str]) -> None:
    for key, value in env_example.items():
        if SECRET_VAR.search(key):
            assert value == "change-me", f".env.example: {key} must be the placeholder change-me, not {value!r}"


def test_env_file_is_git_ignored() -> None:
    ignored = {line.strip() for line in (REPO / ".gitignore").read_text(encoding="utf-8").splitlines()}
    assert ".env" in ignored


# --- Airflow configuration -----------------------------------------------------------------------------


def test_airflow_core_settings(airflow_services: dict[str, dict[str, Any]], services: dict[str, dict[str, Any]],
                               env_example: dict[str, str]) -> None:
    for name, service in airflow_services.items():
        raw = environment(service)
        env = resolved_airflow_env(service, env_example)
        conn = env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
        assert conn.startswith("mysql+pymysql://") and "@mysql:3306/airflow" in conn, f"{name}: {conn}"
        url = re.fullmatch(r"http://([\w-]+):(\d+)/execution/", env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"])
        assert url and url.group(1) == "airflow-apiserver" and int(url.group(2)) in container_ports(services[url.group(1)])
        for key in ("AIRFLOW__API_AUTH__JWT_SECRET", "AIRFLOW__CORE__FERNET_KEY", "AIRFLOW__API__SECRET_KEY"):
            assert PURE_REFERENCE.match(raw[key]), f"{name}: {key} must come from .env"
        assert env["AIRFLOW__CORE__LOAD_EXAMPLES"].lower() == "false"


def test_auth_is_simple_auth_manager_with_a_managed_password(airflow_services: dict[str, dict[str, Any]],
                                                             env_example: dict[str, str]) -> None:
    """SimpleAuthManager (no FAB provider in constraints.txt): users from the env, password file from init."""
    assert "apache-airflow-providers-fab" not in (REPO / "constraints.txt").read_text()
    init = airflow_services["airflow-init"]
    env = resolved_airflow_env(init, env_example)
    assert env["AIRFLOW__CORE__AUTH_MANAGER"].endswith("SimpleAuthManager")
    assert env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS"] == f"{env_example['AIRFLOW_ADMIN_USER']}:admin"
    password_file = PurePosixPath(env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"])
    assert "AIRFLOW_ADMIN_PASSWORD" in environment(init)
    assert "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE" in AIRFLOW_INIT.read_text(encoding="utf-8")
    for name in ("airflow-init", "airflow-apiserver"):
        assert str(password_file.parent) in mounts(airflow_services[name]), f"{name}: password file not on a volume"


def test_project_settings_resolve(airflow_services: dict[str, dict[str, Any]], env_example: dict[str, str]) -> None:
    """The KB_* environment the containers get is one Settings.from_env accepts, pointing at shipped files."""
    from kb_reindex.services.config import Settings

    env = resolved_airflow_env(airflow_services["airflow-scheduler"], env_example)
    expected = {"KB_EMBEDDER": "ollama", "KB_EMBED_MODEL": "bge-m3", "KB_EMBED_DIM": "1024",
                "KB_PROJECT_ROOT": "/opt/airflow", "KB_KNOWLEDGE_DIR": "/opt/airflow/knowledge/docs",
                "KB_GOLDEN_SET": "/opt/airflow/knowledge/golden.yaml", "KB_REPORTS_DIR": "/opt/airflow/reports"}
    assert {key: env.get(key) for key in expected} == expected
    settings = Settings.from_env(env)
    assert settings.embedder == "ollama" and settings.embed_dim == 1024 and settings.alias == env_example["KB_ALIAS"]
    assert settings.qdrant_url == "http://qdrant:6333" and settings.state_url.startswith("mysql+pymysql://")
    root = PurePosixPath(env["KB_PROJECT_ROOT"])
    for key, kind in (("KB_KNOWLEDGE_DIR", "dir"), ("KB_GOLDEN_SET", "file")):
        local = REPO / PurePosixPath(env[key]).relative_to(root)
        assert (local.is_dir() if kind == "dir" else local.is_file()), f"{key}: {local} not in the repo"
    assert all(resolved_airflow_env(svc, env_example)["KB_EMBED_MODEL"] == env["KB_EMBED_MODEL"]
               for svc in airflow_services.values())


def test_pulled_model_is_the_configured_one(services: dict[str, dict[str, Any]], airflow_services: dict[str, dict[str, Any]],
                                           env_example: dict[str, str]) -> None:
    pulled = interpolate(services["ollama-pull"]["entrypoint"][-1], env_example)
    assert pulled == resolved_airflow_env(airflow_services["airflow-scheduler"], env_example)["KB_EMBED_MODEL"]
    assert "KB_EMBED_MODEL" in services["ollama-pull"]["entrypoint"][-1], "model name defined once, in .env"


# --- Dockerfile ---------------------------------------------------------------------------------------------


def test_dockerfile_builds_on_the_official_image_of_the_pinned_airflow() -> None:
    text = DOCKERFILE.read_text(encoding="utf-8")
    froms = re.findall(r"^FROM\s+(\S+)", text, re.MULTILINE)
    assert len(froms) == 1, froms
    match = re.fullmatch(r"apache/airflow:(\d+\.\d+\.\d+)-python(\d+\.\d+)", froms[0])
    assert match, f"not an official, pinned apache/airflow image: {froms[0]}"
    image_airflow, image_python = match.groups()
    assert image_airflow == "3.3.2"
    constraint = AIRFLOW_VERSION_PIN.findall((REPO / "constraints.txt").read_text(encoding="utf-8"))
    assert constraint == [image_airflow], f"constraints.txt pins apache-airflow {constraint}, the image {image_airflow}"
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    assert f"apache-airflow=={image_airflow}" in pyproject["project"]["optional-dependencies"]["airflow"]
    low = re.search(r">=\s*(\d+\.\d+)", pyproject["project"]["requires-python"])
    assert low and tuple(map(int, image_python.split("."))) >= tuple(map(int, low.group(1).split(".")))


def test_dockerfile_installs_the_project_with_the_constraints() -> None:
    text = DOCKERFILE.read_text(encoding="utf-8")
    instructions = " ".join(text.replace("\\\n", " ").split("\n"))
    assert re.search(r"pip install [^&;]*-c constraints\.txt [^&;]*\"\.\[airflow\]\"", instructions), "pip install line"
    copies = re.findall(r"^COPY\s+(?:--\S+\s+)*(.+?)\s+(\S+)$", text, re.MULTILINE)
    sources = {src for group, _ in copies for src in group.split()}
    for needed in ("pyproject.toml", "constraints.txt", "include/", "dags/", "knowledge/", "docker/airflow/init.sh"):
        assert needed in sources, f"Dockerfile does not COPY {needed}"
    assert any(src.startswith("plugin") for src in sources), "Dockerfile does not COPY plugins/"
    pip_line = text.index("pip install")
    assert text.index("include/") < pip_line < text.index("dags/"), "dependencies layer before the DAGs"
    assert re.search(r"^ARG INSTALL_CELERY_PROVIDER=false$", text, re.MULTILINE), "celery provider is opt-in"
    assert not re.search(r"^\s*(ENV|ARG)\b.*_PIP_ADDITIONAL_REQUIREMENTS", text, re.MULTILINE)


def test_init_script_is_in_the_image_where_compose_runs_it(airflow_services: dict[str, dict[str, Any]]) -> None:
    command = airflow_services["airflow-init"]["command"]
    words = command if isinstance(command, list) else shlex.split(command)
    assert words[0] == "bash"
    copies = dict((dst, src) for src, dst in re.findall(r"^COPY\s+(?:--\S+\s+)*(\S+)\s+(\S+)$",
                                                        DOCKERFILE.read_text(encoding="utf-8"), re.MULTILINE))
    assert copies.get(words[1]) == "docker/airflow/init.sh", f"{words[1]} is not where the Dockerfile copies init.sh"


# --- bootstrap: Connections, pool, databases ---------------------------------------------------------------


def connection_adds(script: str) -> dict[str, dict[str, str]]:
    """Connection id -> fields of each `airflow connections add ID --conn-json "$(conn_json k=v ...)"` (or of
    the `--conn-type ... --conn-host ...` form), continuation lines joined."""
    found: dict[str, dict[str, str]] = {}
    for line in script.replace("\\\n", " ").splitlines():
        match = re.match(r"\s*airflow\s+connections\s+add\s+(\S+)\s+(.*)$", line)
        if not match:
            continue
        conn_id, rest = match.groups()
        fields: dict[str, str] = {}
        as_json = re.fullmatch(r'--conn-json\s+"\$\(conn_json\s+(.*)\)"\s*', rest)
        if as_json:
            for word in shlex.split(as_json.group(1)):
                key, _, value = word.partition("=")
                fields[key] = value
        else:
            words = iter(shlex.split(rest))
            for word in words:
                if word.startswith("--conn-"):
                    key = word.removeprefix("--conn-")
                    fields["conn_type" if key == "type" else key] = next(words, "")
        assert conn_id not in found, f"Connection {conn_id} is added twice"
        found[conn_id] = fields
    return found


def test_init_creates_every_connection_the_dags_use(services: dict[str, dict[str, Any]]) -> None:
    from kb_reindex.airflow import connections as airflow_tasks

    added = connection_adds(AIRFLOW_INIT.read_text(encoding="utf-8"))
    expected = {
        airflow_tasks.QDRANT_CONN_ID: {"conn_type": "qdrant", "host": "qdrant", "port": "6333"},
        airflow_tasks.STATE_CONN_ID: {"conn_type": "mysql", "host": "mysql", "port": "3306", "schema": "kb_state"},
        airflow_tasks.OLLAMA_CONN_ID: {"conn_type": "http", "host": "ollama", "port": "11434"},
    }
    for conn_id, wanted in expected.items():
        assert conn_id in added, f"airflow-init does not create Connection {conn_id}"
        got = added[conn_id]
        assert {key: got.get(key) for key in wanted} == wanted, f"{conn_id}: {got}"
        assert got["host"] in services, f"{conn_id}: host {got['host']} is not a compose service"
    assert re.fullmatch(r"\$\{QDRANT_API_KEY\}", added[airflow_tasks.QDRANT_CONN_ID]["password"])
    assert re.fullmatch(r"\$\{KB_STATE_DB_PASSWORD\}", added[airflow_tasks.STATE_CONN_ID]["password"])
    assert "password" not in added[airflow_tasks.OLLAMA_CONN_ID]
    assert 6333 in container_ports(services["qdrant"])


def test_init_connections_are_idempotent(init_commands: list[list[str]]) -> None:
    """`connections add` fails on an existing id; each add is preceded by a tolerated delete."""
    for index, command in enumerate(init_commands):
        if command[:3] == ["airflow", "connections", "add"]:
            previous = init_commands[index - 1]
            assert previous[:4] == ["airflow", "connections", "delete", command[3]] and previous[-2:] == ["||", "true"]


def test_init_migrates_and_creates_a_pool_per_knowledge_base(init_commands: list[list[str]], tmp_path: Path) -> None:
    assert ["airflow", "db", "migrate"] in init_commands
    # every pool `python -m kb_reindex.airflow.lanes --json` writes (each knowledge base's pool and its slots,
    # KB_BUILD_PARALLELISM as the settings accept it, then on-call's and default_pool) set by one import
    assert ["python", "-m", "kb_reindex.airflow.lanes", "--json", ">", "/tmp/kb-pools.json"] in init_commands
    imports = [cmd for cmd in init_commands if cmd[:3] == ["airflow", "pools", "import"]]
    assert imports == [["airflow", "pools", "import", "/tmp/kb-pools.json"]], imports
    migrate = init_commands.index(["airflow", "db", "migrate"])
    assert init_commands.index(imports[0]) > migrate
    printed = {}
    for registry in ("", "knowledge/registry.yaml"):
        done = subprocess.run([sys.executable, "-m", "kb_reindex.services.registry"], capture_output=True, text=True,
                              timeout=60, env={**os.environ, "KB_PROJECT_ROOT": str(REPO), "KB_REGISTRY": registry})
        assert done.returncode == 0, done.stderr
        printed[registry] = done.stdout.splitlines()
    assert printed == {"": ["kb_qdrant_writes 1"], "knowledge/registry.yaml": ["kb_qdrant_writes__mall_knowledge 1",
                                                                               "kb_qdrant_writes__seller_rules 1"]}
    # as the stack sets them: on-call's pool, and default_pool leaving its slots of the parallelism free
    done = subprocess.run([sys.executable, "-m", "kb_reindex.airflow.lanes"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "KB_PROJECT_ROOT": str(REPO), "KB_REGISTRY": "knowledge/registry.yaml",
                               "KB_ONCALL_POOL": "kb_oncall", "KB_ONCALL_SLOTS": "2", "AIRFLOW__CORE__PARALLELISM": "32"})
    assert done.returncode == 0, done.stderr
    assert [line.split()[:2] for line in done.stdout.splitlines()] == [
        ["kb_qdrant_writes__mall_knowledge", "1"], ["kb_qdrant_writes__seller_rules", "1"], ["kb_oncall", "2"],
        ["default_pool", "28"]]
    as_json = subprocess.run([sys.executable, "-m", "kb_reindex.airflow.lanes", "--json"], capture_output=True,
                             text=True, timeout=60, env={**os.environ, "KB_PROJECT_ROOT": str(REPO),
                                                         "KB_REGISTRY": "knowledge/registry.yaml",
                                                         "KB_ONCALL_POOL": "kb_oncall", "KB_ONCALL_SLOTS": "2",
                                                         "AIRFLOW__CORE__PARALLELISM": "32"})
    assert as_json.returncode == 0, as_json.stderr
    assert {name: pool["slots"] for name, pool in json.loads(as_json.stdout).items()} == {
        "kb_qdrant_writes__mall_knowledge": 1, "kb_qdrant_writes__seller_rules": 1, "kb_oncall": 2, "default_pool": 28}


def test_init_needs_the_secrets_it_uses(airflow_services: dict[str, dict[str, Any]]) -> None:
    script = AIRFLOW_INIT.read_text(encoding="utf-8")
    used = set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)", script))
    env = environment(airflow_services["airflow-init"])
    assert used <= set(env), f"init.sh reads variables airflow-init does not get: {sorted(used - set(env))}"
    assert script.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in script


def test_mysql_init_creates_both_databases(services: dict[str, dict[str, Any]],
                                           airflow_services: dict[str, dict[str, Any]], env_example: dict[str, str]) -> None:
    mysql = services["mysql"]
    initdb = mounts(mysql).get("/docker-entrypoint-initdb.d")
    assert initdb and (REPO / initdb).resolve() == MYSQL_INIT.parent.resolve()
    assert os.access(MYSQL_INIT, os.X_OK), "01-databases.sh should be executable"
    script = MYSQL_INIT.read_text(encoding="utf-8")
    databases = set(re.findall(r"CREATE DATABASE IF NOT EXISTS \\?`(\w+)\\?` CHARACTER SET utf8mb4", script))
    assert databases == {"airflow", "kb_state"}
    used = set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)", script))
    assert used <= set(environment(mysql)), f"the mysql service does not pass {sorted(used - set(environment(mysql)))}"
    env = resolved_airflow_env(airflow_services["airflow-scheduler"], env_example)
    assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].split("/")[-1].split("?")[0] in databases
    assert env["KB_STATE_URL"].split("/")[-1].split("?")[0] in databases


# --- the real tool, where there is one -------------------------------------------------------------------------


def _compose_command() -> list[str] | None:
    docker = shutil.which("docker")
    if docker:
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, text=True, timeout=60)
        if probe.returncode == 0:
            return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


def test_compose_config_validates() -> None:
    command = _compose_command()
    if command is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed")
    result = subprocess.run(
        [*command, "--env-file", str(ENV_EXAMPLE), "-f", str(COMPOSE_FILE), "--profile", "celery", "config", "--quiet"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr


def test_the_stack_serves_the_shipped_registry(airflow_services: dict[str, dict[str, Any]],
                                               env_example: dict[str, str], tmp_path: Path) -> None:
    """KB_REGISTRY points into the image's knowledge/ (copied from ./knowledge), where it resolves as the shipped
    registry with both knowledge bases and their Ollama model."""
    from kb_reindex.services.registry import load_registry

    env = resolved_airflow_env(airflow_services["airflow-scheduler"], env_example)
    assert env["KB_REGISTRY"] == "/opt/airflow/knowledge/registry.yaml"
    image_root = tmp_path / "opt-airflow"  # the image's /opt/airflow, as the Dockerfile fills it
    shutil.copytree(REPO / "knowledge", image_root / "knowledge")
    registry = load_registry({**env, "KB_PROJECT_ROOT": str(image_root),
                              "KB_REGISTRY": str(image_root / "knowledge" / "registry.yaml")})
    assert registry.names == ["mall_knowledge", "seller_rules"] and registry.errors == ()
    for kb in registry.bases:
        settings = kb.settings({**env, "KB_PROJECT_ROOT": str(image_root)})
        assert settings.embedder == "ollama" and settings.embed_model == "bge-m3"
        assert settings.knowledge_dir.is_dir() and settings.qdrant_url == "http://qdrant:6333"
