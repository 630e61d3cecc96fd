"""The REST API and the status page (``appliance.api``): a FastAPI app
(:mod:`.app`) over the controller's :class:`~hpclb.controller.operations.Operations`,
served by uvicorn in a thread of `hpclb run` (:class:`.server.ApiFace`).
"""
