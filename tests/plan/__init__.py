"""The pure plans (cpupin/plan/): CPU plans, placement, binding decisions, over random hosts."""
