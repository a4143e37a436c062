"""The standalone/spoke reconcile handlers (kopf): validate.py -> render/ -> kube.py -> status, the
model cache and the autoscaler daemon. Importing a module registers its handlers; which modules a role
imports is decided in one place, ``main.ROLE_HANDLERS``.
"""
