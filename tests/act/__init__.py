"""What changes the host or the process (cpupin/act/): binding, server plans, holds, IRQ moves."""
