"""One exception type for every cache problem. Messages say what is wrong and how to fix it."""


class CacheError(ValueError):
    pass
