"""`tiering-bench serve`: the serving benchmark, a real vLLM server driven over HTTP with and
without this engine (needs vLLM: the environment of README's third set-up command)."""
