"""A/B benchmarks: every comparison runs both sides in one invocation, interleaved."""
