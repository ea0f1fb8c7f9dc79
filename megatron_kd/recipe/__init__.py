"""The recipe: its schema (what a recipe may contain; the shipped ones are in megatron_kd/recipes/), the checks run
before any work, and how a name is composed."""
