"""The Waker sets asyncio events from another thread, and the events set before the loop runs share one loop
callback (one wake-up of the loop per engine step, not one per stream)."""
import asyncio
import threading

from lmkit.serve.completions import Waker


def test_events_set_from_a_thread_share_one_loop_callback():
    async def main():
        loop = asyncio.get_running_loop()
        waker = Waker(loop)
        events = [asyncio.Event() for _ in range(5)]
        scheduled = []
        original = loop.call_soon_threadsafe

        def counting(callback, *args):
            scheduled.append(callback)
            return original(callback, *args)

        loop.call_soon_threadsafe = counting
        worker = threading.Thread(target=lambda: [waker.wake(e) for e in events])
        worker.start()
        worker.join()  # every wake came before the loop ran again
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), timeout=5)
        assert len(scheduled) == 1
        waker.wake(events[0])  # after a flush, the next wake schedules its own
        await asyncio.sleep(0)
        assert len(scheduled) == 2 and not waker.pending

    asyncio.run(main())
