"""A trained student out as a Hugging Face checkpoint."""
