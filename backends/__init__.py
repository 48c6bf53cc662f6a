"""Secondary tiers for the tiering engine."""

from backends.example import ExampleSecondaryTierManager

__all__ = ["ExampleSecondaryTierManager"]
