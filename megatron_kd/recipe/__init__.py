"""The recipe: its schema (what recipes/ may contain), the checks run before any work, and how a name is composed."""
