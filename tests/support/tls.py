"""One TLS context for every HTTP client of a test process.

httpx builds a new context for each client it makes, reading the whole CA bundle: about 20-30 ms
of CPU each time on a 2-core machine, where a helper that polls a server five times a second spent
15 % of a core on that alone, and the fast tier 11 CPU-seconds in all. The tests speak plain HTTP;
the context is there because httpx asks for one. ``verify=CONTEXT`` still verifies as the default
does."""

import httpx

CONTEXT = httpx.create_ssl_context()
