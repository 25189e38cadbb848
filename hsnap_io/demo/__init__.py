"""Demo pieces for hsnap: a tiny random-weight hybrid (attention + GDN) model and explicit decode loop."""
