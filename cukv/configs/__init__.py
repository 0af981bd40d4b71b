"""Frozen kernel configs: one dataclass per kernel family, fields = template parameters."""
