"""loraplex on several engines: Ray Serve replicas routed by adapter (`ray_serve.py`),
data parallel on one host (`data_parallel.py`), both behind the same ingress
(`ingress.py`) and routing policy (`routing.py`).

`serve run loraplex.deploy:app args="MODEL --replicas 2 ..."` runs the Ray Serve
application on an existing cluster (Ray is imported only then).
"""


def app(builder_args: dict):
    """Serve's application builder: `args` is a `loraplex serve` command line."""
    from loraplex.deploy.ray_serve import app as build

    return build(builder_args)
