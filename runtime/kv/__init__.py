"""KV pages in memory (`hicache.runtime.kv`): the page layout every pool and store shares
(`kv_layout`), one tier's pages as one preallocated tensor (`kv_pool`), batched copies between
pools off the event loop (`copy_engine`), and the digests that name a page's bytes (`kv_digest`).
The bottom of the runtime: it imports no other package of `hicache.runtime`, only the core, the
shared modules, torch and trio."""
