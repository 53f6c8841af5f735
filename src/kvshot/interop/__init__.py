"""Drafters in other formats: export to and import from EAGLE-3 / SpecForge heads."""
