"""``crosskd serve``: the teacher answering top-K signals online over HTTP (``docs/serving.md``).

:mod:`~crosskd.serve.protocol` is the wire format, shared with the client
(:mod:`crosskd.teacher.remote`, a layer below the server); :mod:`~crosskd.serve.config` the
server's config, :mod:`~crosskd.serve.batcher` its queue and batching,
:mod:`~crosskd.serve.server` the HTTP server and :func:`~crosskd.serve.server.serve`. This
package imports none of them, so the client's import of the protocol loads no server code.
"""
