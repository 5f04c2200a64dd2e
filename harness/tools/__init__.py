"""Commands around the cost model: predict (one config), plan (search layouts), calibrate (measure
this machine). Their command lines are `python -m harness.predict|plan|calibrate`."""
