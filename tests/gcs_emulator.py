"""A local Google Cloud Storage emulator for tests: `python tests/gcs_emulator.py BUCKET`.

Serves gcp-storage-emulator's in-memory GCS JSON API on a free port of 127.0.0.1 (loopback only) with BUCKET
created, prints `port N` when it accepts requests, and runs until it is terminated. The emulator's server
handles one connection at a time; a client with several event loops (Orbax's background threads beside
fsspec's) can then wait on a connection the server never reaches, so its requests are served on threads here.
Its storage is not safe for threads (a copy beside a delete lost an object), so each request runs its handler
under one lock: connections are served concurrently, the storage sees one request at a time.
"""

import http.server
import sys
import threading

from gcp_storage_emulator import server


def _one_at_a_time(handle):
    lock = threading.Lock()

    def locked(self, method):
        with lock:
            return handle(self, method)

    return locked


def main() -> None:
    server.Router.handle = _one_at_a_time(server.Router.handle)
    http.server.HTTPServer = http.server.ThreadingHTTPServer  # what the emulator's APIThread.run builds
    emulator = server.create_server("127.0.0.1", 0, in_memory=True, default_bucket=sys.argv[1])
    emulator.start()
    print(f"port {emulator._api._httpd.server_address[1]}", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
