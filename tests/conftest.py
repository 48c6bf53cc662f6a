import subprocess
import threading

import pytest

from tests import helpers
from tiering import ReqContext
from tiering.testing.s3_server import MotoServer
from tiering.testing.valkey_server import ValkeyCluster, ValkeyServer

# Test credentials for the local S3 server, and no other source of them: no config files,
# no instance metadata service (botocore would otherwise try an address off this machine).
S3_ENVIRONMENT = {
    "AWS_ACCESS_KEY_ID": "test-access-key",
    "AWS_SECRET_ACCESS_KEY": "test-secret-key-never-printed",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": "/nonexistent/aws-config",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
}


@pytest.fixture
def ctx() -> ReqContext:
    return ReqContext("req-0")


@pytest.fixture(autouse=True)
def no_leaked_threads_or_shared_memory():
    """Every test must stop the runtimes and thread pools it started, and release its
    shared-memory regions."""
    before = set(threading.enumerate())
    regions_before = helpers.engine_regions()
    yield
    leftovers = helpers.regions_left_behind(regions_before)  # not another engine's on the machine
    assert leftovers == [], f"shared memory left behind: {leftovers}"
    for thread in threading.enumerate():
        if thread not in before and thread.name.startswith("tiering"):
            thread.join(5)  # pools wind down asynchronously after shutdown(wait=False)
    leaked = [t.name for t in threading.enumerate() if t not in before and t.name.startswith("tiering")]
    assert leaked == [], f"threads left running: {leaked}"


@pytest.fixture(scope="session")
def s3_environment():
    with pytest.MonkeyPatch.context() as patch:
        for name, value in S3_ENVIRONMENT.items():
            patch.setenv(name, value)
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
            patch.delenv(name, raising=False)
        yield S3_ENVIRONMENT


@pytest.fixture(scope="session")
def s3_server(s3_environment):
    """One moto S3 server for the session, on a free loopback port."""
    server = MotoServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server) -> str:
    """A fresh, empty bucket for one test."""
    name = helpers.region_name()
    s3_server.create_bucket(name)
    return name


@pytest.fixture(scope="session")
def valkey_server():
    """One standalone redis-server for the session, on a free loopback port (each test
    uses a key prefix of its own)."""
    server = ValkeyServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def valkey_cluster():
    """One 3-node redis-server cluster for the session (no replicas), on free loopback ports."""
    cluster = ValkeyCluster(primaries=3)
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def key_prefix() -> str:
    """A key prefix no other test uses, so tests sharing a server never see each other's keys."""
    return helpers.region_name()


@pytest.fixture
def engine_factory():
    engines = []

    def make(config, **kwargs):
        engines.append(helpers.Engine(config, **kwargs))
        return engines[-1]

    yield make
    for engine in reversed(engines):  # the last made first, as resources are released
        engine.close()


@pytest.fixture
def small_disk(tmp_path):
    """A real tmpfs of 1 MiB that fills up for real (needs the right to mount)."""
    mount = tmp_path / "disk"
    mount.mkdir(mode=0o700)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mount)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)
