"""State pools as pytrees (paged KV, draft KV, GDN state, slot buffers) and host-side allocators."""
