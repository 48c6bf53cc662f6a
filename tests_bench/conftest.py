# The engine suite's fixtures, under the same names and rules (no leaked threads or shared memory).
from tests.conftest import (  # noqa: F401
    ctx,
    key_prefix,
    no_leaked_threads_or_shared_memory,
    s3_bucket,
    s3_environment,
    s3_server,
    valkey_server,
)
