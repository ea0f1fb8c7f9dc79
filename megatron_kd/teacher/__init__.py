"""Teachers: the online teacher, the Megatron teacher of the cache builder, its forward-only pipeline, and cache builds from a recipe."""
