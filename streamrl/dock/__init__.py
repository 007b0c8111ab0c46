"""streamrl.dock: the transfer dock, through which a pipeline's stages exchange samples.

A metadata controller (:mod:`~streamrl.dock.controller` serving the bookkeeping of
:mod:`~streamrl.dock.state`) says which sample may be read by whom; warehouses
(:mod:`~streamrl.dock.warehouse`) hold the column values. Stages use
:class:`~streamrl.dock.client.DockClient`; :mod:`~streamrl.dock.launch` starts a dock;
:mod:`~streamrl.dock.authz` says what each role of a run may do there. The wire
protocol (:mod:`~streamrl.dock.protocol`, :mod:`~streamrl.dock.codec`) is docs/dock-protocol.md.
"""
