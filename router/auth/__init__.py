"""Client authentication (API keys stored as sha256 hashes, grouped in tenants).

`router.auth.config` holds the `auth:` section of regions.yaml; `router.auth.keys` the
request-path lookup; `router.auth.endpoints` the workers' endpoint allow-lists. Kept free
of imports from router.config (which imports from here).
"""
