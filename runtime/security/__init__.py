"""Who may talk to a node, and how much they may hold (`hicache.runtime.security`): the cluster
secret (`cluster_secret`), the challenge–response between nodes over it (`peer_auth`), clients'
API keys and tenants (`api_keys`), and the limits on connections, bytes in flight and time each
listening node enforces (`limits`). It may import `wire` (its messages are control frames), never
storage, transfer, tp, a node or serving."""
