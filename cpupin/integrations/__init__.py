"""cpupin inside other engines, each a package of its own: ``vllm``, vLLM's
general plugin. Nothing here is imported by ``import cpupin``."""
