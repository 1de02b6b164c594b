"""The property fuzzers' shared settings: a bounded run in CI, a long one with CAI_DLPACK_FUZZ_EXAMPLES=N."""
import os

from hypothesis import HealthCheck, settings

EXAMPLES = int(os.environ.get("CAI_DLPACK_FUZZ_EXAMPLES", "400"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))


def fewer(divisor):
    """Settings for a fuzzer whose examples cost more: EXAMPLES // divisor of them (at least 20)."""
    return settings(FUZZ, max_examples=max(EXAMPLES // divisor, 20))
