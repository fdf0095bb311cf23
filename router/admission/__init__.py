"""Admission: who may send a request now (auth, model access, global rate limits).

`gate.Admission` is what the proxy calls; `limiter.RateLimiter` decides limits in Redis
(`redis_limiter`, global) or in this process (`gcra.LocalLimiter`, while Redis is down);
`stats.SecurityStats` counts every decision for /metrics.
"""
