"""The load-aware router (`iterserve router`): one HTTP endpoint in front of engine replicas.

In: OpenAI API requests from clients; the replica list (a static --endpoints list, or the Ready
pods of an InferenceService watched on the API server: discovery.py); each replica's /metrics,
scraped every ~200 ms (endpoints.py). Out: each request proxied to the replica with the least
load, answers streamed back unchanged (proxy.py, http.py); 429 + Retry-After when every replica
is saturated, 503 when none is ready; the router's own /metrics (metrics.py). The decision is a
pure function, `picking.pick`, shared with the simulator; prefix affinity is in prefix.py.
"""
