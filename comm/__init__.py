"""Everything distributed (topology, all-to-all, expert-parallel dispatchers). No MoE math here."""
