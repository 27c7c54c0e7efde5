"""`gagpo view`: a local, read-only web app over one store or several (docs/inspect.md).

    data.py     what each page reads: queries through the `gagpo sql` sandbox
                (inspection/sql.py, the store's one reader) and the estimators recomputed
                for one group (pipeline/advantages.py); no HTTP here
    pools.py    what the pools page reads, by counts, through the same session
    access.py   who may ask: loopback by default, an access token for any other address,
                loopback Host names only (DNS rebinding), security headers
    app.py      the Starlette app: pages, JSON endpoints, packaged assets, one-line errors
    cli.py      what `gagpo view` does once parsed: check the bind, run uvicorn (the
                command's options are workflows/view.py, which passes the environments'
                step oracle in: this layer may not import actors/)
    static/     the pages' HTML, JS and CSS, and uPlot (the charting library), shipped
                in the package: nothing is fetched from the internet at run time

Starlette, uvicorn and the assets are the `view` extra; importing this package needs none.
"""
