"""The operators' surface: admin API (status, drain/undrain, reload), the status page.

Kept free of imports here: the proxy imports `router.registry.drains` on its own.
"""
