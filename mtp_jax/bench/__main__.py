from mtp_jax.bench import main

raise SystemExit(main())
