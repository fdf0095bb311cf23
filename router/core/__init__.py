"""The shared types every layer of the router may use: a request as parsed, its outcome,
the API's error shape, the security counters. Imports nothing else of the router."""
