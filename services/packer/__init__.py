"""The packer: trajectory buffer, ready groups, GRPO advantages, micro-step packing and
atomic claims (see ARCHITECTURE.md, "Streaming training")."""
