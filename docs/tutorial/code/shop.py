"""The tutorial's shop: an order charges a card; the charge is recorded on the order and
a receipt is enqueued in the transaction that records the payment; receipts go out at
most 2 per second, Resend's default limit."""

import os
import sys

import psycopg

import outbox
from effects.email import EmailPayload, SendEmail
from effects.payments import ChargeCard, ChargePayload

DSN = os.environ["OUTBOX_DATABASE_URL"]


def place_order(order_id: int, email: str, amount: int) -> None:
    """The order row and its charge commit together, or neither does."""
    with psycopg.connect(DSN) as conn, outbox.transaction(conn) as tx:
        conn.execute("CREATE TABLE IF NOT EXISTS orders (id int PRIMARY KEY, email text,"
                     " amount int, charge_id text)")
        conn.execute("INSERT INTO orders (id, email, amount) VALUES (%s, %s, %s)",
                     (order_id, email, amount))
        tx.enqueue("payment.charge", key=f"charge-order-{order_id}",
                   ordering_key=f"order-{order_id}",
                   payload=ChargePayload(amount=amount, currency="eur",
                                         customer="cus_tutorial", payment_method="pm_card_visa",
                                         metadata={"order_id": str(order_id), "email": email}))


def record_charge(tx: outbox.HookTransaction, job: outbox.Job, result: dict) -> None:
    """Runs in the transaction that marks the charge done: all of it commits, or none."""
    order_id, email = job.payload["metadata"]["order_id"], job.payload["metadata"]["email"]
    tx.execute("UPDATE orders SET charge_id = %s WHERE id = %s", (result["id"], int(order_id)))
    tx.enqueue("email.send", key=f"receipt-order-{order_id}", ordering_key=job.ordering_key,
               payload=EmailPayload(from_="Shop <orders@shop.example>", to=email,
                                    subject=f"Receipt for order {order_id}",
                                    text=f"We charged {result['amount'] / 100:.2f} EUR."))


dispatcher = outbox.Dispatcher(
    DSN,
    [ChargeCard(api_key=os.environ["STRIPE_API_KEY"], base_url=os.environ["STRIPE_BASE_URL"]),
     SendEmail(api_key=os.environ["RESEND_API_KEY"], base_url=os.environ["RESEND_BASE_URL"])],
    on_done={"payment.charge": record_charge},
    limits={"email.send": outbox.Limit(rate=2.0)},
    lease=10,  # seconds: a killed worker's jobs are taken back 10 s after it died
)

if __name__ == "__main__":  # python shop.py FIRST_ORDER COUNT
    first, count = int(sys.argv[1]), int(sys.argv[2])
    for order_id in range(first, first + count):
        place_order(order_id, f"customer{order_id}@example.com", 1000 + order_id)
    print(f"placed {count} orders")
