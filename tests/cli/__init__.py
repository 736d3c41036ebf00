"""The cpupin command (cpupin/cli/): every subcommand, its errors, its JSON shapes."""
