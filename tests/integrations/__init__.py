"""The vLLM plugin (cpupin/integrations/vllm/): its decisions, and a real server."""
