"""The operators' surface: admin API (status, drain/undrain, reload), the status page.

Kept free of imports here: the proxy imports `router.admin.drains` on its own.
"""
