from services.decode.main import main

main()
